"""Before any weight loads: the whole-config check (`validate`), which reads every room it checks -- the base
folder's files and a resume's checkpoint (file_checks), whether the base fits where it loads (load_checks), what the
trainer libraries would refuse only after the load (trainer_checks), whether the disk holds the checkpoints
(disk_space). It stands above config/, data/, plan/, artifacts/ and train/ so that none of them imports upward."""
