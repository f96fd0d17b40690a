"""Collectives among the workers: the ring all-reduce (``ring``), the reduction ops
(``ops``), the API with Horovod's names (``api``) and torch.distributed as the
production backend (``torch_backend``)."""
