from eva_fastclip.cli import main

if __name__ == "__main__":  # not when a spawned or forkserver process imports the main module again
    raise SystemExit(main())
