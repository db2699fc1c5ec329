"""Where a sweep's simulations run: in this process, a local process pool, or a Ray cluster.

Every executor runs the same function, :func:`simulate_task`, on the same task mappings (a resolved
single-policy scenario with absolute paths), so the results do not depend on where they ran. The
interface the sweep driver uses::

    with make_executor("local", workers=2) as ex:   # or "ray" (address=None: a local instance)
        ex.submit(task_payload)                     # non-blocking
        outcome = ex.wait_one()                     # blocks until some submitted task is done
        ex.slots                                    # how many run at once

``ray`` is imported only by :class:`RayExecutor`.
"""

from __future__ import annotations

import os
import time
import traceback
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from multiprocessing import get_context

from sim.config import ScenarioError

EXECUTORS = ("local", "ray")


def _error_text(e: BaseException) -> str:
    """One line: a user mistake's own message, or the exception's type, message and where it was raised."""
    if isinstance(e, ScenarioError):
        return " / ".join(str(e).splitlines())
    frames = traceback.extract_tb(e.__traceback__)
    where = f" (at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno})" if frames else ""
    return f"{type(e).__name__}: {' '.join(str(e).split())}{where}"


def simulate_task(payload: dict) -> dict:
    """Run one task (``{"key", "policy", "scenario"}``) and return its outcome as a JSON-able mapping:
    the policy's summary and the workload's, or the error it stopped with (never raises)."""
    from sim.config import parse_scenario
    from sim.run import run

    t0 = time.perf_counter()
    out = _outcome(payload, None)
    try:
        scenario = parse_scenario(payload["scenario"], f"task {payload['key']}", base_dir="/")
        result = run(scenario, read_trace=payload.get("read_trace"))  # the trace reader the sweep passed in
        out["summary"] = result.policies[payload["policy"]].summary
        out["workload"] = result.workload_summary()
    except Exception as e:  # one failing task must not stop the others: report it with its error
        out["error"] = _error_text(e)
    out["wall_s"] = time.perf_counter() - t0
    return out


def _outcome(payload: dict, error: str | None) -> dict:
    return {"key": payload["key"], "policy": payload["policy"], "summary": None, "workload": None, "error": error,
            "wall_s": 0.0}


class Executor:
    """The interface: ``submit``, ``wait_one``, ``close``, ``slots``, ``name``; a context manager that closes."""

    name = "executor"
    slots = 1

    def submit(self, payload: dict) -> None:
        raise NotImplementedError

    def wait_one(self) -> dict:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> "Executor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class SerialExecutor(Executor):
    """Runs each task in this process when it is waited for (``--workers 1``; tests and debugging)."""

    name = "serial"
    slots = 1

    def __init__(self) -> None:
        self._queue: deque[dict] = deque()

    def submit(self, payload: dict) -> None:
        self._queue.append(payload)

    def wait_one(self) -> dict:
        return simulate_task(self._queue.popleft())

    def close(self) -> None:
        self._queue.clear()


def _die_with_parent(parent_pid: int) -> None:
    """A worker's start: it ends when the sweep that started it ends, however that ends (SIGKILL too).
    Linux: the kernel sends SIGKILL when the parent dies (prctl PR_SET_PDEATHSIG); elsewhere, and as a
    second guard, a daemon thread exits the worker once its parent is gone."""
    import signal
    import threading
    import time

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle (it cancels the pool)
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="kvsim-parent-watch").start()


class LocalExecutor(Executor):
    """A pool of worker processes on this machine (default: one per core). Workers are spawned, not
    forked: they start clean whatever threads the driver runs (the progress bar has one)."""

    name = "local"

    def __init__(self, workers: int | None = None) -> None:
        self.slots = workers or os.cpu_count() or 1
        self._pool = ProcessPoolExecutor(max_workers=self.slots, mp_context=get_context("spawn"),
                                         initializer=_die_with_parent, initargs=(os.getpid(),))
        self._futures: dict[Future, dict] = {}

    def submit(self, payload: dict) -> None:
        self._futures[self._pool.submit(simulate_task, payload)] = payload

    def wait_one(self) -> dict:
        done, _ = wait(self._futures, return_when=FIRST_COMPLETED)
        future = next(iter(done))
        payload = self._futures.pop(future)
        try:
            return future.result()
        except Exception as e:  # the worker process died (killed, out of memory): the task failed
            return _outcome(payload, f"worker process failed: {_error_text(e)}")

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class RayExecutor(Executor):
    """Tasks as Ray remote functions (one CPU each). Connects to ``address`` (``auto``: the cluster
    started on this machine with ``ray start``), uses an already initialised Ray, or starts a local
    instance with ``workers`` CPUs (default: all) and stops it when done.

    On a cluster, every node needs kvsim installed and the scenario's files (traces, model configs) at
    the same absolute paths as on the machine that starts the sweep."""

    name = "ray"

    def __init__(self, workers: int | None = None, address: str | None = None) -> None:
        try:
            import ray
        except ImportError:
            raise ScenarioError("--executor ray needs Ray: pip install 'kvsim[ray]' (or pip install ray)") from None
        self._ray = ray
        self._started = False
        if not ray.is_initialized():
            kwargs = dict(include_dashboard=False, log_to_driver=False, logging_level="WARNING")
            try:
                if address:
                    _reachable(address)
                    ray.init(address=address, **kwargs)
                else:
                    ray.init(num_cpus=workers, **kwargs)
            except ConnectionError as e:
                raise ScenarioError(f"--address {address}: cannot connect to a Ray cluster ({e})") from None
            except ValueError as e:  # ray.init's "Invalid address format: bogus"
                raise ScenarioError(f"--address {address}: not a Ray address ({e}); expected host:port, "
                                    f"ray://host:port or auto") from None
            self._started = True
        cpus = int(ray.cluster_resources().get("CPU", 1))
        self.slots = max(1, min(workers, cpus) if workers else cpus)
        self._remote = ray.remote(num_cpus=1, max_retries=0)(simulate_task)
        self._refs: dict = {}

    def submit(self, payload: dict) -> None:
        self._refs[self._remote.remote(payload)] = payload

    def wait_one(self) -> dict:
        ready, _ = self._ray.wait(list(self._refs), num_returns=1)
        payload = self._refs.pop(ready[0])
        try:
            return self._ray.get(ready[0])
        except Exception as e:  # the worker died or the node went away: the task failed
            return _outcome(payload, f"ray task failed: {_error_text(e)}")

    def close(self) -> None:
        for ref in self._refs:
            self._ray.cancel(ref, force=True)
        self._refs.clear()
        if self._started:
            self._ray.shutdown()


def _reachable(address: str, timeout_s: float = 10.0) -> None:
    """A Ray address (``host:port`` or ``ray://host:port``; ``auto`` is Ray's to find) that takes a TCP
    connection: ray.init retries an unreachable one for minutes instead of failing."""
    hostport = address.split("://", 1)[-1]
    host, _, port = hostport.rpartition(":")
    if address == "auto" or not host or not port.isdigit():
        return  # (Ray says what is wrong with it)
    import socket

    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ScenarioError(f"--address {address}: cannot connect to a Ray cluster there ({e})") from None


MAX_WORKERS = 1024  # worker processes of one machine (a huge -j overflowed a C int in the process pool)


def make_executor(kind: str = "local", workers: int | None = None, address: str | None = None):
    """``local`` (a process pool; ``workers=1``: in this process) or ``ray``."""
    if workers is not None and (not isinstance(workers, int) or isinstance(workers, bool)):  # (the Python API)
        raise TypeError(f"workers is a {type(workers).__name__}; expected a whole number from 1 to {MAX_WORKERS:,}")
    if workers is not None and not 1 <= workers <= MAX_WORKERS:
        raise ScenarioError(f"--workers must be between 1 and {MAX_WORKERS:,} (got {workers:,})")
    if kind == "local":
        if address:
            raise ScenarioError("--address is for --executor ray")
        return SerialExecutor() if workers == 1 else LocalExecutor(workers)
    if kind == "ray":
        if address is not None and not address.strip():  # (an unset shell variable: --address "$RAY")
            raise ScenarioError("--address: an empty address (give host:port, ray://host:port or auto; leave "
                                "--address out to start a Ray instance here)")
        return RayExecutor(workers, address)
    raise ScenarioError(f"--executor {kind!r}: expected one of {', '.join(EXECUTORS)}")
