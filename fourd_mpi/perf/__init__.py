"""The performance model: communication volumes, memory, machine profiles, predictions, the
grid tuner, calibration/validation against traces, and the collective micro-benchmark
(``collbench``, the one module here that runs under mpiexec).
"""
