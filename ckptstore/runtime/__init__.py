"""Runtime helpers every layer may use: TensorStore futures and work off the event loop
(`futures`), the collector paused around allocation bursts (`gcpause`), JAX's key-value
store (`distributed`) and the collective steps built on it (`handoff`), and the memory a
read must fit before its buffer is sized (`membudget`)."""
