"""What a training step is made of, shared by the transforms that shape it and the trainer that runs it.

The transforms (:mod:`hone.transforms`) decide how a step runs; the trainer (:mod:`hone.train`)
runs it. Both need the same few contracts: who this process is among the run's
(:mod:`~hone.runtime.world`), the module the loop calls once per micro-batch and the loss it
computes (:mod:`~hone.runtime.step`, :mod:`~hone.runtime.loss`), and how a run's state is written
and read (:mod:`~hone.runtime.checkpoints`). They live here, below both packages, so that neither
imports the other's internals and the import graph has no circle.
"""
