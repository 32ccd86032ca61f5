"""Gray failures: what happens to a frozen worker, a silent parameter server and a straggler.

An instance the backend still reports alive can fail the job all the same. The master gives such an instance
up, fences it and stops it; its end is then a loss like a kill, and the relaunch policy replaces it.

- `hang.py`    a worker that holds work and commits nothing past its bound is hung. HangBounds, how long
  silence may last, is built once from --hang-timeout and given to every watch.
- `ps_watch.py`  a PS shard that does not answer the master's probe past its bound is hung; while a shard is
  silent, the workers' clocks hold (a push waits on it: not the worker's fault).
- `straggler.py`  ps: an idle worker takes a much slower worker's lease ahead, or the tail of its lease.
- `ring_straggler.py`  allreduce: a member much slower than the others is left out of the ring.
- `fence.py`   a launch given up can apply nothing: the master, the shards and the ring refuse it.
- `policy.py`  the job's pump asks the watches each turn, fences and stops whoever is past its bound, and
  turns the end of an instance given up into the loss it was given up for.

The watches are plain data, with no clock and no threads (the PS probe's thread aside): the coordinator keeps
them under its lock and passes `now`. Fencing, not the bound, is what keeps exactly-once: a bound can be wrong,
a fence cannot.
"""
