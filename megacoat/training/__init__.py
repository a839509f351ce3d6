"""Training: the DeepSpeed engine set-up, the train/eval loop, logging, FLOP/MFU accounting and checkpoints."""
