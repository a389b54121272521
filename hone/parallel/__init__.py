"""Parallelism that changes what a rank computes, below the models that use it.

:mod:`~hone.parallel.expert_parallel` splits the routed experts of a mixture-of-experts layer
across the ranks of a process group and moves each token to its experts' rank and back.
:mod:`~hone.parallel.context_parallel` splits each sequence along its length over ``N`` ranks
and trades positions for attention heads around attention (all-to-alls of
:mod:`~hone.parallel.exchange`). They import only :mod:`hone.kernels` and ``torch.distributed``,
so the experts backend (:mod:`hone.models.experts`) and the attention backend
(:mod:`hone.models.attention.ulysses`) can call them.
"""
