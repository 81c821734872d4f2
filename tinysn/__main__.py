from .cli import main

if __name__ == "__main__":      # not when a worker process re-imports it (spawn)
    raise SystemExit(main())
