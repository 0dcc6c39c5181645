"""The shared status of a stage process: a ``multiprocessing.Array`` of doubles, ``N_SLOTS`` per stage (stage i's
slot k at ``i * N_SLOTS + k``), written by the stage (``ringshm.runtime.stage``) and read by the launcher and the
other stages' ``ThreadPicker``."""

N_SLOTS = 4
SLOT_STATE, SLOT_BUSY_S, SLOT_OPS, SLOT_ACTIVE = 0, 1, 2, 3  # ACTIVE: 1.0 while the stage computes an op
STARTING, LOADED, FAILED, EXITED = 0.0, 1.0, 2.0, 3.0  # SLOT_STATE's values
