"""`nodeserve plan`: the policy core on a virtual clock, with step times from the measured cost model."""
