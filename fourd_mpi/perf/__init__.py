"""The performance model, and only the model: communication volumes, memory, machine profiles, predictions,
the grid tuner, and the calibration fits of a machine profile (:mod:`~fourd_mpi.perf.calibration`). Pure: no
module here runs MPI or reads a trace, and none imports a package above ``perf`` (docs/design.md section 7).
The micro-benchmark that measures a machine is :mod:`fourd_mpi.run.collbench`; the model checked against
traces is :mod:`fourd_mpi.analysis.model_check`.
"""
