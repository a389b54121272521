"""The process group's backend: NCCL on GPUs, gloo on CPUs, and both on GPUs when FSDP2's CPU
offload keeps gradient shards on the host (the global grad norm reduces over them there)."""

from hone.train.distributed import backend_for


def test_backend_per_device_and_cpu_offload():
    assert backend_for("cuda") == "nccl"
    assert backend_for("cpu") == "gloo"
    assert backend_for("cpu", cpu_collectives=True) == "gloo"
    assert backend_for("cuda", cpu_collectives=True) == "cuda:nccl,cpu:gloo"
