"""Worker processes of the tests skip Keras' optional integrations.

`import keras` imports scikit-learn (its `SKLearnClassifier` wrappers),
matplotlib (`plot_image_gallery`) and IPython (`saving.file_editor`) when
they are installed, as they are in the project's environment for the
examples and notebooks: about 1.1 s of the 3.6 s a worker takes to import
TensorFlow and Keras (measured on the 2-core CI machine), in each of the
suite's hundreds of worker processes. keras-smp uses none of them; Keras
treats a missing one as not installed. `tests/conftest.py::env` puts this
folder on `PYTHONPATH` for workers, and leaves it off for the examples,
notebooks and drawings that use them (`env(lean=False)`).
"""

import sys

for _name in ("sklearn", "matplotlib", "IPython"):
    # `None` in sys.modules: `import sklearn` raises ImportError.
    sys.modules.setdefault(_name, None)
