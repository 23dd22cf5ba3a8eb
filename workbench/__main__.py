from workbench.cli import main

if __name__ == "__main__":  # not when a spawned child (vLLM's engine core) re-imports it
    main()
