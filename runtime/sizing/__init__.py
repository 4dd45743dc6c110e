"""Sizing: how many draft nodes each sequence's tree gets, above the drafters (which never import it).

cost_curve.py   the target's forward timed by rows (the batch-1 curve), trees sized by it, live accuracies (LiveSizer)
batch_cost.py   the batched forward's cost by width and rows
planner.py      the load planner: every sequence's offers against the batch's cost, one plan a round
budgeted.py     a request's drafter under the planner: its offers at a price, the tree it is given
gate.py         the explicit switches: plain rounds past --speculate-up-to, a queue depth or below break-even
policy.py       the speculation policy by name (budget, fixed, off), built for the server's worker and the bench
"""
