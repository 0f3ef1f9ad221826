from meshrun.cli import run

run()
