"""The pieces of scale-out below the engine's executor, which import nothing of the engine: a tensor-parallel
group's collectives (group.py, shm_allreduce.py), how a model splits over ranks (sharding.py,
parallel_model.py), the KV connector of disaggregated prefill and decode (kv_connector.py) and the choice of
a replica (balance.py). The executors, workers, Ray placement and core groups that use them are engine/'s."""
