# PyInstaller runtime hook: runs in the frozen lnn-field before any app code (so before Numba is imported).
# Numba's cache locators do not work in a frozen app; ours puts the kernel cache in lnn's per-user folder.
import os

os.environ["NUMBA_CACHE_LOCATOR_CLASSES"] = "numba_cache_locator.FrozenAppCacheLocator"
