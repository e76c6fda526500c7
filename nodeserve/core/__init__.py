"""The policy core: every decision about what runs where, made on plain data. No torch, no threads.

The engine's runtime (nodeserve/runtime) and the simulator behind `nodeserve plan` (nodeserve/plan) run these same
functions; neither makes a policy decision of its own. Where each decision is made:

  may a request queue at all?         admission.py    SloAdmission.check (predicted TTFT / TPOT vs the SLO);
                                                      runtime/router.py raises TooLarge / QueueFull on plain limits
  which device prefills, which decodes placer.py      StaticPlacer.place (disaggregated, colocated),
                                                      AdaptivePlacer.place -> placement.choose_placement
  what a placement is predicted to do placement.py    predict (TTFT, own TPOT, TPOT of the decodes it stalls)
  which devices are dedicated to prefill roles.py     RolePolicy.update / free_a_seat / request_loads
  where a dedicated device's decodes go placer.py     plan_moves
  what one device runs next           scheduler.py    Scheduler.schedule (decodes, then prefill chunks, FIFO)
  what a step's outcome does          scheduler.py    Scheduler.postprocess (tokens, ends, handoffs, frees)
  which pages a step sends elsewhere  handoff.py      copy_plan (committed only after the forward succeeded)
  how a live move proceeds            handoff.py      next_migration_step (pre-copy round, stop, give up)
  how long a step takes               cost_model.py   CostModel.step_time, transfer_time / transfer_tail

What they decide on: load.py's DeviceLoad (one device at one moment), built from live workers by runtime/loads.py
and from virtual devices by plan/simulate.py. Pages are handed out only by kv/manager.py's KVManager.
"""
