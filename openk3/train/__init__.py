"""The trainer library: the step and loop (``trainer``), the run's settings (``run_config``),
Per-Head Muon + QK-Clip (``muon``), parameter groups and LR schedule (``optim``), Quantile
Balancing of the router bias (``balance``), checkpoints (``checkpointing``), metrics files and the
progress bar (``metrics``), packed loaders (``data``, ``mixed_data``, ``vision_loader``), the BPE
trainer (``tokenizer_train``); the distributed parts in ``openk3.train.distributed``."""
