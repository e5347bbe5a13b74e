"""Demo data sets and example networks: small real tasks for the demo, the examples and the
benchmarks, kept out of the library's core (nothing in spec/, cost/, plan/ or run/'s engine
imports them)."""
