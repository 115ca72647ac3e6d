"""The RL algorithm and its run: `loop.py` (`rl_step`: generate → score → log-probs → update →
push) and every mechanism it drives, each in the module named after it."""
