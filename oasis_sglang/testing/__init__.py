"""Testing helpers: start and stop real SGLang servers (``launch``) for the main job, the tests
and the benchmarks. Not used by the serving path."""
