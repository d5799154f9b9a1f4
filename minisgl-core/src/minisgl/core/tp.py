"""Tensor parallelism: N rank processes, each a Scheduler + Engine with 1/N of the weights.

Rank 0 takes the requests. Before each step it broadcasts what changed since the last one (requests
added, aborted) over the control channel; every other rank applies the same changes to its own
scheduler and runs the same step. Schedulers are deterministic given the same inputs, and the
sampled tokens are the same on every rank by construction: rank 0 samples and broadcasts them
(Engine.run). So every rank builds the same batch, with the same KV slots, at every step.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

from minisgl.core.child import die_with_parent
from minisgl.core.config import EngineConfig
from minisgl.core.distributed import ControlChannel, connect
from minisgl.core.gc_pause import paused
from minisgl.core.request import Req
from minisgl.core.sampling_params import SamplingParams
from minisgl.core.scheduler import Scheduler


def _params_dict(p: SamplingParams) -> dict[str, Any]:
    return dataclasses.asdict(p)


class Lockstep:
    """Rank 0's view of the scheduler at TP > 1: records add/abort and sends them to the other
    ranks with the next step. At TP = 1 (no channel) it is a thin pass-through."""

    def __init__(self, scheduler: Scheduler, channel: ControlChannel | None) -> None:
        self.scheduler = scheduler
        self.channel = channel
        self.pending: list[dict[str, Any]] = []

    def add(self, req: Req) -> None:
        self.scheduler.add(req)
        if self.channel is not None:
            self.pending.append({"op": "add", "rid": req.rid, "prompt": req.prompt_ids,
                                 "params": _params_dict(req.params)})

    def abort(self, rid: int) -> Req | None:
        req = self.scheduler.abort(rid)
        if self.channel is not None and req is not None:
            self.pending.append({"op": "abort", "rid": rid})
        return req

    def clear_cache(self) -> None:
        self.scheduler.clear_cache()
        if self.channel is not None:
            self.pending.append({"op": "clear_cache"})

    def step(self) -> list[Req]:
        self.sync(step=True)
        return self.scheduler.step()

    def drain(self) -> list[Req]:
        if self.channel is not None:
            self.sync(drain=True)
        return self.scheduler.drain()

    def sync(self, step: bool = False, drain: bool = False) -> None:
        """Send what changed (and whether a step or drain follows). Also the idle heartbeat."""
        if self.channel is None:
            return
        ops = self.pending + ([{"op": "step"}] if step else []) + ([{"op": "drain"}] if drain else [])
        self.pending = []
        self.channel.send(ops)

    def close(self) -> None:
        channel, self.channel = self.channel, None
        try:
            if channel is not None:
                channel.send(self.pending + [{"op": "exit"}])
        except RuntimeError:
            pass  # a rank is gone (the error was raised where it happened): nobody to tell
        finally:
            self.pending = []
            self.scheduler.close()

    def __getattr__(self, name: str) -> Any:  # validate, has_work, stats, ... of the scheduler
        return getattr(self.scheduler, name)


def follow(scheduler: Scheduler, channel: ControlChannel) -> None:
    """A rank > 0: apply rank 0's changes and run the same steps until told to exit."""
    eos = frozenset(scheduler.engine.model_config.eos_token_ids)
    while True:
        for op in channel.recv():
            kind = op["op"]
            if kind == "add":
                scheduler.add(Req(op["prompt"], SamplingParams(**op["params"]), eos, rid=op["rid"]))
            elif kind == "abort":
                scheduler.abort(op["rid"])
            elif kind == "step":
                scheduler.step()
            elif kind == "drain":
                scheduler.drain()
            elif kind == "clear_cache":
                scheduler.clear_cache()
            elif kind == "exit":
                scheduler.close()
                return


def physical_cores(sysfs: str = "/sys/devices/system/cpu") -> int:
    """The physical cores among the CPUs this process may run on: SMT siblings (a core's second
    hardware thread) count once, as in torch's default thread count. Where Linux's topology
    files are missing, every CPU counts."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
        else list(range(os.cpu_count() or 1))
    cores: set[tuple[str, str]] = set()
    for cpu in cpus:
        topology = os.path.join(sysfs, f"cpu{cpu}", "topology")
        try:
            with open(os.path.join(topology, "physical_package_id")) as f:
                package = f.read().strip()
            with open(os.path.join(topology, "core_id")) as f:
                cores.add((package, f.read().strip()))
        except OSError:
            cores.add(("cpu", str(cpu)))
    return max(1, len(cores))


def cpu_threads(config: EngineConfig, local_ranks: int) -> int | None:
    """Torch threads for a CPU rank (None: leave torch's default): ``config.threads``, else at
    TP > 1 the physical cores split among the ``local_ranks`` ranks on this machine (unless
    OMP_NUM_THREADS says otherwise), as many threads in all as torch gives one process. More
    threads than cores in total makes OpenMP teams wait on each other (measured 20x slower
    decode with 3 ranks x 2 threads on 2 cores)."""
    if config.torch_device.type != "cpu":
        return None
    if config.threads is not None:
        return config.threads
    if config.tp_size == 1 or "OMP_NUM_THREADS" in os.environ:
        return None
    return max(1, physical_cores() // local_ranks)


def start_rank(config: EngineConfig, addr: str, local_ranks: int = 1,
               dead_ranks: Callable[[], list[int]] | None = None
               ) -> tuple[Scheduler, ControlChannel | None]:
    """This process's rank of the group: connect, load its slice of the model, build a scheduler.
    ``local_ranks``: how many ranks share this machine (sets torch's CPU threads at TP > 1)."""
    with paused():  # the engine's Python objects live as long as it (gc_pause)
        import torch

        from minisgl.core.engine import Engine

        threads = cpu_threads(config, local_ranks)
        if threads is not None:
            torch.set_num_threads(threads)
        if config.tp_size == 1:
            return Scheduler(Engine(config)), None
        comm, channel = connect(config.tp_rank, config.tp_size, addr, config.torch_device,
                                config.dist_timeout, dead_ranks,
                                same_host=local_ranks == config.tp_size)
        return Scheduler(Engine(config, comm)), channel


def run_rank(config: EngineConfig, addr: str, local_ranks: int) -> None:
    """Entry point of a rank > 0 process (offline LLM or server)."""
    die_with_parent()
    scheduler, channel = start_rank(config, addr, local_ranks)
    assert channel is not None
    follow(scheduler, channel)
