import os, sys, runpy
sys.setswitchinterval(float(os.environ.get("SI", "0.005")))
sys.argv[0] = "app.py"
runpy.run_path("app.py", run_name="__main__")
