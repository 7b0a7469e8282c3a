"""Tiered storage, the whole feature: a `Tiered` target (`target`), what a save on tiers
adds (`save`: the room check, host-local staging), reads from the nearest good copy
(`read`), free space on the fast tier (`room`), host-local fast tiers (`hostlocal`),
promotion to the durable tier (`promote`) and what an incremental step reads from, made
durable first (`holders`), where each step is (`status`), and deletion and gc over both
tiers (`cleanup`)."""
