"""The save path: :class:`~ckpt.save.engine.SaveEngine` and the stages it is built from (planning,
snapshot, writer, commit protocol, retention). ``Checkpointer`` and ``ckpt.dcp.Writer`` both save
through one engine per root."""
