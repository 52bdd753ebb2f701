"""The DeepSpeed side: engine set-up, the training loop and its step hooks, checkpoints.

Only this package and eva_fastclip.losses.gather touch torch.distributed / deepspeed.
"""
