"""The training step: local kernels, the 4D layers, the model, synthetic data, optimizers,
the overlap options and schedule, the step engine and the model presets.
"""
