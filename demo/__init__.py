"""The Gradio comparison app (``app.py``). A wheel installs this folder as ``diffalign._demo``, so that
``diffalign demo`` runs it outside a checkout; in a checkout ``python demo/app.py`` runs it too."""
