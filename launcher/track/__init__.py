"""Experiment trackers: the protocol every tracker implements and the record of a run's tracker runs (protocol.py),
one tracker per file (TensorBoard, MLflow, W&B), and the group of them that rank 0 logs to (trackers.py)."""
