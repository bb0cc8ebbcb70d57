"""The decode core: one verify pass at a time, for one stream or a batch."""
