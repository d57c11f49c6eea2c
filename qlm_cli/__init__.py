"""qlm's command line: parse, call qlm_core, render with rich."""
