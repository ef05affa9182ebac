"""Event-clock simulator (SmartSpec sec. 7.2; docs/design.md sec. 9).

The real scheduler (`Scheduler` over a `BlockAllocator` sized like the engine's), the real
speculation policies (`make_policy`), the real draft rounds (`draft_rounds`, `step_info`)
and the engine's step books (runtime/step_books.py) run step by step on a simulated clock; model forwards are priced by a cost
profile (the profiler's file format) and verify outcomes come from a stochastic acceptance
process fitted to a measured calibration.

    engine.py       Simulator: arrivals, the event clock, admission (like Engine.add_request)
    step.py         SimStepRunner: one step, runtime.step.StepRunner's calls with priced forwards
    drafter.py      SimDrafter: the Drafter interface without a model
    acceptance.py   the acceptance process (per-request Beta confidences, calibration g)
    target.py       SimTarget: `python -m sloserve.replay --target sim --profile FILE`
    pool.py         policies simulated in worker processes (--sim-workers)
    fidelity.py     python -m sloserve.sim.fidelity (a shim: cli/fidelity.py): real engine vs
                    simulator
    gpu_profiles.py python -m sloserve.sim.gpu_profiles: GPU profiles from published figures
"""
