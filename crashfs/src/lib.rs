//! crashfs: an in-memory FUSE filesystem (on the `fuser` crate) that loses power on
//! command, for the end-to-end power-loss tests of shmckpt (issue 28; docs/crash.md).
//!
//! The model (ext4-like, stricter where POSIX is):
//!
//! - every inode has a **live** state (what the running system reads) and a **durable**
//!   one (what survives a power loss);
//! - a file's data and size become durable at its `fsync`/`fdatasync` (all of them: no
//!   tearing, no reordering here; the simulated harness, crate `shmckpt-crashsim`, covers those);
//!   a file created and never synced is durable as an empty file, if its name is;
//! - a directory's entries (create, mkdir, rename, unlink, rmdir) become durable at the
//!   directory's own `fsync` (all of them at once, as a journal commit); a file's `fsync`
//!   does not make its name durable (ext4 would, POSIX does not promise it);
//! - a **power cut** ([`Power::cut`], or the `n`-th mutating request with
//!   [`Power::cut_at_mutation`]) fails that request and every later one with `EIO` (the
//!   trainer's process is as good as dead), and [`Power::durable_image`] is what a reboot
//!   finds: the tree reachable from the root through durable entries, each inode with its
//!   durable contents. [`Mounted::mount`] serves any [`Image`] again.
//!
//! Nothing is cached by the kernel that this filesystem does not see: no writeback cache,
//! so every `write` (buffered or `O_DIRECT`) reaches it before the call returns, and every
//! `fsync` is a request (implemented; `ENOSYS` would make the kernel skip them).

use std::collections::{BTreeMap, HashMap};
use std::ffi::{OsStr, OsString};
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo,
    MountOption, OpenFlags, RenameFlags, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory,
    ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs, ReplyWrite, Request, TimeOrNow, WriteFlags,
};

mod fuse;
use fuse::CrashFs;

const TTL: Duration = Duration::from_secs(1);
const ROOT: u64 = 1;

#[derive(Clone, Debug)]
enum Body {
    File(Vec<u8>),
    Dir(BTreeMap<OsString, u64>),
}

impl Body {
    fn kind(&self) -> FileType {
        match self {
            Body::File(_) => FileType::RegularFile,
            Body::Dir(_) => FileType::Directory,
        }
    }
}

#[derive(Clone, Debug)]
struct Inode {
    live: Body,
    durable: Body,
    perm: u16,
}

/// The contents of a crashfs: every inode's live and durable state.
#[derive(Clone, Debug)]
pub struct Image {
    inodes: HashMap<u64, Inode>,
    next_ino: u64,
}

impl Default for Image {
    fn default() -> Self {
        Image::empty()
    }
}

impl Image {
    /// An empty root directory, durable.
    pub fn empty() -> Image {
        let root = Inode {
            live: Body::Dir(BTreeMap::new()),
            durable: Body::Dir(BTreeMap::new()),
            perm: 0o755,
        };
        Image {
            inodes: HashMap::from([(ROOT, root)]),
            next_ino: ROOT + 1,
        }
    }

    /// A copy of the directory tree at `dir` (regular files and directories only), all of
    /// it durable.
    pub fn from_dir(dir: &Path) -> io::Result<Image> {
        let mut img = Image::empty();
        img.load_dir(dir, ROOT)?;
        Ok(img)
    }

    fn load_dir(&mut self, dir: &Path, ino: u64) -> io::Result<()> {
        for e in std::fs::read_dir(dir)? {
            let e = e?;
            let t = e.file_type()?;
            let body = if t.is_dir() {
                Body::Dir(BTreeMap::new())
            } else if t.is_file() {
                Body::File(std::fs::read(e.path())?)
            } else {
                return Err(io::Error::other(format!(
                    "{}: only files and directories",
                    e.path().display()
                )));
            };
            let child = self.add(body);
            let parent = self.inodes.get_mut(&ino).expect("parent");
            for b in [&mut parent.live, &mut parent.durable] {
                if let Body::Dir(m) = b {
                    m.insert(e.file_name(), child);
                }
            }
            if t.is_dir() {
                self.load_dir(&e.path(), child)?;
            }
        }
        Ok(())
    }

    fn add(&mut self, body: Body) -> u64 {
        let ino = self.next_ino;
        self.next_ino += 1;
        let perm = if matches!(body, Body::Dir(_)) {
            0o755
        } else {
            0o644
        };
        self.inodes.insert(
            ino,
            Inode {
                durable: body.clone(),
                live: body,
                perm,
            },
        );
        ino
    }

    /// Write the live tree into the empty directory `dir`.
    pub fn write_to(&self, dir: &Path) -> io::Result<()> {
        self.write_dir(ROOT, dir)
    }

    fn write_dir(&self, ino: u64, dir: &Path) -> io::Result<()> {
        let Some(Body::Dir(m)) = self.inodes.get(&ino).map(|i| &i.live) else {
            return Err(io::Error::other("not a directory"));
        };
        for (name, &child) in m {
            let path = dir.join(name);
            match &self.inodes[&child].live {
                Body::File(d) => std::fs::write(&path, d)?,
                Body::Dir(_) => {
                    std::fs::create_dir(&path)?;
                    self.write_dir(child, &path)?;
                }
            }
        }
        Ok(())
    }

    /// What a reboot finds: the tree reachable from the root through durable entries,
    /// each inode with its durable contents (live and durable alike).
    pub fn durable(&self) -> Image {
        let mut out = Image {
            inodes: HashMap::new(),
            next_ino: self.next_ino,
        };
        let mut todo = vec![ROOT];
        while let Some(ino) = todo.pop() {
            if out.inodes.contains_key(&ino) {
                continue; // no hard links are made, but never loop
            }
            let i = &self.inodes[&ino];
            if let Body::Dir(m) = &i.durable {
                todo.extend(m.values().copied());
            }
            out.inodes.insert(
                ino,
                Inode {
                    live: i.durable.clone(),
                    durable: i.durable.clone(),
                    perm: i.perm,
                },
            );
        }
        out
    }

    /// Every live path (relative, `/`-separated) with `None` for a directory and the bytes
    /// of a file.
    pub fn tree(&self) -> BTreeMap<PathBuf, Option<Vec<u8>>> {
        let mut out = BTreeMap::new();
        let mut todo = vec![(ROOT, PathBuf::new())];
        while let Some((ino, path)) = todo.pop() {
            if let Body::Dir(m) = &self.inodes[&ino].live {
                for (name, &child) in m {
                    let p = path.join(name);
                    match &self.inodes[&child].live {
                        Body::File(d) => {
                            out.insert(p, Some(d.clone()));
                        }
                        Body::Dir(_) => {
                            out.insert(p.clone(), None);
                            todo.push((child, p));
                        }
                    }
                }
            }
        }
        out
    }
}

#[derive(Debug)]
struct State {
    img: Image,
    dead: bool,
    mutations: u64,
    cut_at: Option<u64>,
    next_fh: u64,
    uid: u32,
    gid: u32,
    born: SystemTime,
}

impl State {
    /// Admit one mutating request, or fail it: the power is off, or goes off now.
    fn mutate(&mut self) -> Result<(), Errno> {
        if self.dead {
            return Err(Errno::EIO);
        }
        if self.cut_at == Some(self.mutations) {
            self.dead = true;
            return Err(Errno::EIO);
        }
        self.mutations += 1;
        Ok(())
    }

    fn alive(&self) -> Result<(), Errno> {
        if self.dead { Err(Errno::EIO) } else { Ok(()) }
    }

    fn inode(&self, ino: INodeNo) -> Result<&Inode, Errno> {
        self.img.inodes.get(&ino.0).ok_or(Errno::ENOENT)
    }

    fn inode_mut(&mut self, ino: INodeNo) -> Result<&mut Inode, Errno> {
        self.img.inodes.get_mut(&ino.0).ok_or(Errno::ENOENT)
    }

    fn dir_mut(&mut self, ino: INodeNo) -> Result<&mut BTreeMap<OsString, u64>, Errno> {
        match &mut self.inode_mut(ino)?.live {
            Body::Dir(m) => Ok(m),
            Body::File(_) => Err(Errno::ENOTDIR),
        }
    }

    fn file_mut(&mut self, ino: INodeNo) -> Result<&mut Vec<u8>, Errno> {
        match &mut self.inode_mut(ino)?.live {
            Body::File(d) => Ok(d),
            Body::Dir(_) => Err(Errno::EISDIR),
        }
    }

    fn child(&self, parent: INodeNo, name: &OsStr) -> Result<u64, Errno> {
        match &self.inode(parent)?.live {
            Body::Dir(m) => m.get(name).copied().ok_or(Errno::ENOENT),
            Body::File(_) => Err(Errno::ENOTDIR),
        }
    }

    fn attr(&self, ino: u64) -> Result<FileAttr, Errno> {
        let i = self.img.inodes.get(&ino).ok_or(Errno::ENOENT)?;
        let (size, nlink) = match &i.live {
            Body::File(d) => (d.len() as u64, 1),
            Body::Dir(_) => (4096, 2),
        };
        Ok(FileAttr {
            ino: INodeNo(ino),
            size,
            blocks: size.div_ceil(512),
            atime: self.born,
            mtime: self.born,
            ctime: self.born,
            crtime: self.born,
            kind: i.live.kind(),
            perm: i.perm,
            nlink,
            uid: self.uid,
            gid: self.gid,
            rdev: 0,
            blksize: 4096,
            flags: 0,
        })
    }

    fn new_node(&mut self, parent: INodeNo, name: &OsStr, body: Body) -> Result<u64, Errno> {
        if self.child(parent, name).is_ok() {
            return Err(Errno::EEXIST);
        }
        self.dir_mut(parent)?; // a directory, before anything changes
        self.mutate()?;
        let ino = self.img.add(body.clone());
        // Not durable until synced: a new file's durable contents are empty, a new
        // directory's durable entries none.
        self.img.inodes.get_mut(&ino).expect("just added").durable = match body {
            Body::File(_) => Body::File(Vec::new()),
            Body::Dir(_) => Body::Dir(BTreeMap::new()),
        };
        self.dir_mut(parent)?.insert(name.to_owned(), ino);
        Ok(ino)
    }
}

/// The power switch of a mounted crashfs (cloneable, usable from any thread).
#[derive(Clone, Debug)]
pub struct Power(Arc<Mutex<State>>);

impl Power {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Cut the power now: every later request fails with `EIO`.
    pub fn cut(&self) {
        self.lock().dead = true;
    }

    /// Cut the power at the `n`-th mutating request from the mount on (0: the first), which
    /// fails, as every later one does.
    pub fn cut_at_mutation(&self, n: u64) {
        self.lock().cut_at = Some(n);
    }

    /// Whether the power is off.
    pub fn is_cut(&self) -> bool {
        self.lock().dead
    }

    /// Mutating requests served so far (creates, mkdirs, writes, truncates, fallocates,
    /// renames, unlinks, rmdirs, fsyncs).
    pub fn mutations(&self) -> u64 {
        self.lock().mutations
    }

    /// What a reboot would find now.
    pub fn durable_image(&self) -> Image {
        self.lock().img.durable()
    }

    /// Everything, synced or not (what a clean unmount keeps).
    pub fn live_image(&self) -> Image {
        self.lock().img.clone()
    }
}

/// Each inode's parent in the live tree.
fn parents(img: &Image) -> HashMap<u64, u64> {
    let mut out = HashMap::new();
    for (&ino, i) in &img.inodes {
        if let Body::Dir(m) = &i.live {
            for &c in m.values() {
                out.insert(c, ino);
            }
        }
    }
    out
}

/// A mounted crashfs. Dropping it unmounts.
pub struct Mounted {
    session: Option<fuser::BackgroundSession>,
    power: Power,
    mountpoint: PathBuf,
}

impl std::fmt::Debug for Mounted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mounted")
            .field("mountpoint", &self.mountpoint)
            .finish()
    }
}

impl Mounted {
    /// Serve `image` at `mountpoint` (an existing directory). Needs `/dev/fuse` and the
    /// right to mount (root: the `mount` system call; fuser falls back to `fusermount3`
    /// otherwise).
    pub fn mount(image: Image, mountpoint: &Path) -> io::Result<Mounted> {
        let meta = std::fs::metadata(mountpoint)?;
        let power = Power(Arc::new(Mutex::new(State {
            img: image,
            dead: false,
            mutations: 0,
            cut_at: None,
            next_fh: 0,
            uid: meta.uid(),
            gid: meta.gid(),
            born: SystemTime::now(),
        })));
        let mut config = fuser::Config::default();
        config.mount_options = vec![
            MountOption::FSName("crashfs".into()),
            MountOption::Subtype("crashfs".into()),
        ];
        let session = fuser::spawn_mount(CrashFs(power.clone()), mountpoint, &config)?;
        Ok(Mounted {
            session: Some(session),
            power,
            mountpoint: mountpoint.to_owned(),
        })
    }

    /// The power switch.
    pub fn power(&self) -> &Power {
        &self.power
    }

    /// The mount point.
    pub fn path(&self) -> &Path {
        &self.mountpoint
    }

    /// Cut the power (if it is not already off), unmount, and return what a reboot finds.
    /// Close every descriptor of the mount first (a busy mount is detached lazily).
    pub fn crash(mut self) -> Image {
        self.power.cut();
        self.unmount_now();
        self.power.durable_image()
    }

    /// Unmount cleanly and return everything written (a clean unmount syncs it all).
    pub fn unmount(mut self) -> Image {
        self.unmount_now();
        self.power.live_image()
    }

    fn unmount_now(&mut self) {
        if let Some(s) = self.session.take()
            && let Err(e) = s.umount_and_join()
        {
            // Busy (a dying process's files not yet released): detach it lazily, so that
            // no dead mount stays under the next one.
            eprintln!(
                "crashfs: unmounting {}: {e}; detaching it",
                self.mountpoint.display()
            );
            let _ = std::process::Command::new("umount")
                .arg("-l")
                .arg(&self.mountpoint)
                .status();
        }
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        self.unmount_now();
    }
}

/// Whether this process can mount a FUSE filesystem here: `/dev/fuse` opens read-write
/// and the process is root (the `mount` system call; without root fuser needs the
/// setuid `fusermount3`). `Err` says what is missing.
pub fn can_mount() -> Result<(), String> {
    if let Err(e) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/fuse")
    {
        return Err(format!("/dev/fuse: {e}"));
    }
    let uid = std::fs::metadata("/proc/self")
        .map_err(|e| format!("/proc/self: {e}"))?
        .uid();
    if uid != 0 {
        return Err(format!("not root (uid {uid})"));
    }
    Ok(())
}
