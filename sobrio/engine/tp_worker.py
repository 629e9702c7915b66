"""A tensor-parallel rank other than 0: load this rank's share of the model, then run each step rank 0
broadcasts until it sends None (or goes away: its connections close, the collective raises, we exit).

Started as `python -c "from sobrio.engine.tp_worker import main; main()"` (a child of the engine-core
process, which is itself a daemon and may not fork multiprocessing children), or inside a Ray actor
(`ray_workers.py`). The start arguments come pickled on stdin; nothing of a request ever reaches a worker but
token ids, positions and block tables.
"""

import ctypes
import logging
import os
import pickle
import signal
import sys
from dataclasses import dataclass

from sobrio.config import SobrioConfig
from sobrio.errors import where

logger = logging.getLogger(__name__)


@dataclass
class WorkerArgs:
    config: SobrioConfig
    rank: int
    size: int
    host: str
    port: int
    log_level: int = logging.INFO


def run_worker(args: WorkerArgs) -> None:
    from sobrio.distributed.group import TPGroup
    from sobrio.distributed.sharding import TPRank, plan_shards
    from sobrio.engine.model_runner import ModelRunner
    from sobrio.loader.load import load_model_files

    files = load_model_files(args.config.model_config, tokenizer=False)
    shards = plan_shards(files.config, args.size)
    group = TPGroup.join(args.rank, args.size, args.host, args.port)
    runner = ModelRunner(args.config, files, tp=TPRank(shards[args.rank], shards, group))
    logger.info("tensor-parallel rank %d of %d ready", args.rank, args.size)
    try:
        while (step := group.broadcast()) is not None:
            runner.run(step)
    except RuntimeError as exc:  # gloo: rank 0 (or another rank) closed its connection
        logger.warning("tensor-parallel rank %d: the group is gone (%s); exiting", args.rank,
                       str(exc).split("]")[-1].strip()[:120])
        return
    group.close()
    logger.info("tensor-parallel rank %d stopped", args.rank)


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the process that started it dies (PR_SET_PDEATHSIG)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def main() -> None:
    args: WorkerArgs = pickle.load(sys.stdin.buffer)
    _die_with_parent()
    logging.basicConfig(level=args.log_level,
                        format=f"%(asctime)s %(levelname)s %(name)s[tp{args.rank}]: %(message)s")
    try:
        run_worker(args)
    except Exception as exc:  # type and place only: a message may quote the batch's tokens
        logger.error("tensor-parallel rank %d failed: %s at %s", args.rank, type(exc).__name__, where(exc))
        os._exit(1)


if __name__ == "__main__":
    main()
