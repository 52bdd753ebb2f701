"""The DeepSpeed side: engine set-up, the training loop and its step hooks, checkpoints.

Of the library, only this package and eva_fastclip.losses.gather touch torch.distributed / deepspeed;
besides them only the tools on top of it do: export (DeepSpeed's ZeRO checkpoint reader) and bench/.
"""
