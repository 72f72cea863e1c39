"""Training: Per-Head Muon + QK-Clip (``muon``), parameter groups and LR schedule (``optim``),
Quantile Balancing of the router bias (``balance``)."""
