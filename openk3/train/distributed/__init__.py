"""The trainer under ``torchrun``: the run context (:mod:`~openk3.train.distributed.run`), FSDP2
(:mod:`~openk3.train.distributed.parallel`), expert parallelism
(:mod:`~openk3.train.distributed.expert_parallel`) and sharded Muon + QK-Clip
(:mod:`~openk3.train.distributed.muon`)."""
