"""What gets trained: model/data/loss builders per task, named from conf/ by `_target_`."""
