"""Parallelism that changes what a rank computes, below the models that use it.

:mod:`~hone.parallel.expert_parallel` splits the routed experts of a mixture-of-experts layer
across the ranks of a process group and moves each token to its experts' rank and back. It
imports only :mod:`hone.kernels` and ``torch.distributed``, so the experts backend
(:mod:`hone.models.experts`) can call it.
"""
