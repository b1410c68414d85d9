"""Advantages and losses: pure tensor functions shared by both training backends."""

# The --advantage-estimator choices, here rather than in advantages.py so that config/ can offer them
# without importing torch (parsing flags stays cheap).
ESTIMATORS = ("grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo")
