"""The drafter models: DFlash, DFlash 2 and DSpark blocks, their configs and checkpoints, the oracle; and the
drafters shipped with the package (one folder each)."""
