"""Crash recovery: who owns each response's work, and what happens when an owner is lost.

- :mod:`resq.recovery.generations`: a generation job is claimed by one GPU worker at a
  time; every token it publishes is fenced by the claim's epoch, so a worker that lost
  its claim (a zombie) can no longer append to the response's token stream.
- :mod:`resq.recovery.leases`: a post-processor holds a renewable lease on each response
  it processes; a lapsed lease lets another post-processor take the response over.
- :mod:`resq.recovery.reaper`: the background pass, run by every process, that finds
  lost work and dispatches it again, hands it over, or fails it.
- :mod:`resq.recovery.dispatch`: sending generation jobs through Celery and seeing which
  ones wait in the ``generate`` queue.

``docs/reliability.md`` describes the failure model these modules implement.
"""
