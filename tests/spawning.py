"""Multi-process tests run their ranks through `run_ranks`: forked from a server process
that imported torch and mixprec once, one thread each, in a gloo process group this module
owns, and bounded in time.

The group is destroyed only after the worker has returned and everything it built is freed:
a group freed after `destroy_process_group` with its last holder (a DistributedDataParallel
wrapper, an FSDP mesh, a scaler's group) can deadlock its process at exit, as a quarter of
the runs of one two-process DDP test did here. A rank that hangs anyway prints every
thread's stack and exits, so the test fails with where it stood instead of stalling the
suite for the group's 30-minute default timeout."""

from __future__ import annotations

import faulthandler
import gc
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mixprec.trainer.strategy import end_finished_process, free_port, fresh_start_method

LIMIT_S = 300.0
# the ranks of a multi-process test: two, one per core of the machines CI runs on
WORLD = 2


# Ranks fork from a server process that imported torch and mixprec once (a spawned rank
# imports them afresh: seconds, twice a test), the one the Trainer's launches fork from
# (`fresh_start_method`: spawned where that server's environment is not the test's); each
# takes the test's environment and folder
mp.set_forkserver_preload(["spawning"])


def _rank(
    rank: int,
    worker: Callable[..., None],
    limit_s: float,
    nprocs: int,
    port: int,
    place: tuple[dict[str, str], str],
    *args: Any,
) -> None:
    env, cwd = place
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(nprocs), LOCAL_WORLD_SIZE=str(nprocs),
    )  # fmt: skip
    torch.set_num_threads(1)
    faulthandler.dump_traceback_later(limit_s, exit=True, file=sys.stderr)
    dist.init_process_group("gloo", timeout=timedelta(seconds=limit_s))
    worker(rank, *args)  # an exception leaves the group as it is: the process is ending
    gc.collect()  # what the worker built, cycles included, goes while the group is alive
    dist.barrier()  # no rank leaves while another still talks to it
    dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()
    end_finished_process()  # C++ destructors at exit can still abort a finished rank


def run_ranks(
    worker: Callable[..., None], *args: Any, nprocs: int = 2, limit_s: float = LIMIT_S
) -> None:
    """Run ``worker(rank, *args)`` on `nprocs` fresh ranks and wait for all of them.

    Each rank runs inside an initialized gloo default group, with the environment of a
    torchrun launch (``RANK``, ``WORLD_SIZE``, ``MASTER_PORT``...). A rank's exception fails
    the test with its traceback; a rank still running after `limit_s` dumps its stacks and
    exits.
    """
    port = free_port()
    place = (dict(os.environ), os.getcwd())
    ctx = mp.start_processes(
        _rank,
        args=(worker, limit_s, nprocs, port, place, *args),
        nprocs=nprocs,
        join=False,
        start_method=fresh_start_method(),
    )
    deadline = time.monotonic() + limit_s + 30  # the ranks' own limit fires first
    while not ctx.join(timeout=0.1):
        if time.monotonic() > deadline:
            alive = [rank for rank, p in enumerate(ctx.processes) if p.is_alive()]
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"ranks {alive} of {nprocs} still ran after {limit_s + 30:.0f} s")
