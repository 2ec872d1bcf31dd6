"""
minGPT-DDP's launcher, by its name: `python launch.py` started main.py on every GPU of the machine; torchrun does
that here, and this answers in one line with the command (main.py's answer, Hydra overrides taken alike).
"""
import sys

from seeds import hydra_command

sys.exit(hydra_command(sys.argv[1:]))
