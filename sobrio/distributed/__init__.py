"""Scale-out: tensor parallelism (one model's layers split over ranks), data parallelism (engine replicas
behind one server), Ray placement, and disaggregated prefill and decode (KV blocks shipped between cores)."""
