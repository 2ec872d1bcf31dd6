"""
minGPT-DDP's entrypoint, by its name: `python main.py trainer_config.batch_size=128` (Hydra overrides of its
gpt2_train_cfg.yaml) is answered in one line with this project's command for it, which it does not run: train.py
(fsdp_train.py for trainer_config.distributed_method=fsdp) on the baby GPT's tiny Shakespeare, with our flags.
"""
import sys

from seeds import hydra_command

sys.exit(hydra_command(sys.argv[1:]))
