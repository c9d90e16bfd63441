"""Keras ``model.fit`` on a WorkQueue-fed ``tf.data`` pipeline.

    python examples/tf_keras_fit.py

``input_dataset(epochs="each")`` makes each Keras epoch one epoch of the queue, so
``fit(..., epochs=num_epochs)`` trains queue epoch k in Keras epoch k (a resumed run starts at
``initial_epoch=work_queue.resume_epoch()``); several workers share each epoch, a fast one
reading more files than a slow one. The setup writes six small CSV files to a
temp dir, and the queue to ``$WQ_SQL_URL``, by default a fresh SQLite file in that dir
(``WQ_SQL_URL=postgresql://user@host/db python examples/tf_keras_fit.py``).
"""

import atexit
import os
import random
import tempfile
import warnings

import keras
import tensorflow as tf

import wq_sql
from wq_sql.tf import WorkQueue

# ---- setup: six small CSV files of (x1, x2, label) with label = x1 + x2 > 0
tmp = tempfile.mkdtemp(prefix="wq_sql_tf_keras_")
os.environ.setdefault("WQ_SQL_URL", f"sqlite:///{tmp}/wq.db")
rng = random.Random(7)
files = []
for i in range(6):
    files.append(os.path.join(tmp, f"part-{i}.csv"))
    with open(files[-1], "w") as f:
        for _ in range(64):
            x1, x2 = rng.uniform(-1, 1), rng.uniform(-1, 1)
            f.write(f"{x1:.4f},{x2:.4f},{int(x1 + x2 > 0)}\n")
num_epochs, batch_size = 2, 32


def drop_queue_at_exit():
    """$WQ_SQL_URL may name a shared database: leave no queue there, also after an error. The queue
    is this run's own: its works are this run's temp files, so a queue of the same name from
    elsewhere would have been refused, not joined."""
    if "work_queue" in globals():
        work_queue.close()
        wq_sql.drop_queue(work_queue.name)


atexit.register(drop_queue_at_exit)


def parse(line):
    x1, x2, label = tf.io.decode_csv(line, record_defaults=[0.0, 0.0, 0])
    return tf.stack([x1, x2], axis=-1), label


work_queue = WorkQueue(files, num_epochs=num_epochs, seed=1)
dataset = tf.data.TextLineDataset(work_queue.input_dataset(epochs="each"))
dataset = dataset.shuffle(256, seed=1).batch(batch_size).map(parse).prefetch(1)

keras.utils.set_random_seed(7)
model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, activation="sigmoid")])
model.compile(optimizer=keras.optimizers.Adam(0.3), loss="binary_crossentropy", metrics=["accuracy"])


class CountRecords(keras.callbacks.Callback):
    steps = 0
    taken = 0

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1

    def on_epoch_end(self, epoch, logs=None):
        print(f"Keras epoch {epoch}: {work_queue.taken - self.taken} items")
        self.taken = work_queue.taken


# Keras warns at the end of any dataset of unknown length, and about fit(shuffle=True).
warnings.filterwarnings("ignore", message="Your input ran out of data")
warnings.filterwarnings("ignore", message=".*shuffle=True.* was passed")
counter = CountRecords()
history = model.fit(dataset, epochs=num_epochs, initial_epoch=work_queue.resume_epoch(), verbose=0,
                    callbacks=[counter])
progress = work_queue.progress()
print(f"steps: {counter.steps}")
print(f"items done: {progress.done} of {progress.total}")
# The model learned the rule: check it on fresh points.
test_x = [[rng.uniform(-1, 1), rng.uniform(-1, 1)] for _ in range(200)]
predicted = model.predict(tf.constant(test_x), verbose=0)[:, 0] > 0.5
accuracy = sum(bool(p) == (x1 + x2 > 0) for p, (x1, x2) in zip(predicted, test_x)) / len(test_x)
print(f"loss went down: {history.history['loss'][-1] < 0.6}")
print(f"accuracy on new points above 0.9: {accuracy > 0.9}")
