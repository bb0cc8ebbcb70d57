"""The decode core: one verify pass at a time, for one stream or a batch. Read in this order:

    proposal.py     Offer (what a proposer could draft) and Proposal (the drafts a pass verifies, as a value)
    proposers/      where drafts come from: one module per method (dflash, lookup, plain) behind `Proposer`
    planner.py      which proposer and how wide, each pass (estimators: width.py, sources.py)
    acceptance.py   which drafts the target keeps, greedy or by exact rejection sampling (math: sampling.py)
    state.py        the caches carried between passes, and the prefill
    step.py         the pass step every loop runs (`Decoder`), and the one result type (`Pass`)
    loop.py         one stream, the next pass queued before the current one is yielded
    batching.py     several generations sharing each target pass
    generation.py   what every front end drives: acceptor, planner, statistics, detokenizer around a loop
    lookup.py, stats.py   the context index prompt lookup copies from; τ, histograms, the collapse warning
"""
