"""One OpenMP master per process: the thread that steps the model (the engine thread, a VIT's tower thread).

libgomp gives every thread that runs a parallel region its own pool of workers, and keeps that pool after the
region. Once a process holds more OpenMP threads than it has cores, libgomp spins ~100 times instead of
~300,000 before a waiting worker sleeps, so the engine's workers fall asleep after every region and each next
region first wakes them through the kernel. Measured on 2 cores (2026-11-28): the 135M model's one-stream
decode on the engine thread ran 62 tokens/s with a second pool alive against 206 without; a LLaVA-shaped
prompt with a new image 700-980 ms against 530-650 (the gRPC edge had decoded the image with torch ops on an
executor thread, whose pool then lived on).

So: loading runs on a thread that ends (`in_passing_thread`), and every other thread that may touch torch
while the model serves (the event loop's, the executor's that asyncio.to_thread uses) runs torch's CPU ops on
itself alone (`serial_torch_here`, `helper_executor`). Where torch's OpenMP is not libgomp or Intel's (no
such library loaded) these are no-ops."""
from __future__ import annotations

import asyncio
import ctypes
import functools
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

T = TypeVar("T")


@functools.cache
def _openmp() -> Any | None:
    """The OpenMP runtime torch loaded (never loads one itself)."""
    for name in ("libgomp.so.1", "libiomp5.so"):
        try:
            return ctypes.CDLL(name, mode=getattr(os, "RTLD_NOLOAD", 0))
        except OSError:
            continue
    return None


def serial_torch_here() -> bool:
    """From now on torch's CPU ops on the calling thread run on it alone: no OpenMP pool of its own. Other
    threads keep their width (torch.set_num_threads would change the default new threads take). Returns
    whether it could (False: no OpenMP runtime loaded)."""
    torch.get_num_threads()  # torch sets a thread's OpenMP width on its first use: done first, it cannot undo this
    runtime = _openmp()
    if runtime is None:
        return False
    runtime.omp_set_num_threads(1)
    return torch.get_num_threads() == 1


def one_openmp_master() -> None:
    """At the start of a role's serving coroutine (before loading): the event loop's thread and its executor's
    run torch serially; the model loads on a passing thread (in_passing_thread) and is stepped on its own."""
    serial_torch_here()
    asyncio.get_running_loop().set_default_executor(helper_executor())


def helper_executor() -> ThreadPoolExecutor:
    """The executor for an event loop whose model is stepped elsewhere (loop.set_default_executor): its
    threads decode images, load adapters and the like with serial torch."""
    return ThreadPoolExecutor(thread_name_prefix="helper", initializer=serial_torch_here)


async def in_passing_thread(fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) on a thread that ends when it returns: loading uses every core, and its OpenMP pool ends with
    the thread."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def run() -> None:
        try:
            result = fn(*args)
        except BaseException as exc:  # handed to the awaiting coroutine
            loop.call_soon_threadsafe(future.set_exception, exc)
        else:
            loop.call_soon_threadsafe(future.set_result, result)

    thread = threading.Thread(target=run, name="load", daemon=True)
    thread.start()
    try:
        return await future
    finally:
        await asyncio.to_thread(thread.join)
