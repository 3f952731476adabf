"""``resq bench``: resq against its baselines, in the same run, on this machine.

Not a role: the bench starts the roles as processes, drives them over HTTP and
Redis, and may import any of them (a baseline runs the GPU worker's engine
in-process). Nothing in ``resq/``, ``api/``, ``workers/`` or ``gpu_worker/``
imports it.
"""
