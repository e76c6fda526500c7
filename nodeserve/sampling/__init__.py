"""nodeserve.sampling: turning a step's logits into tokens (penalties, filters, draws, grammar masks)."""
