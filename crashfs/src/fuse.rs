//! The FUSE side of crashfs: [`CrashFs`] answers the kernel's requests from the shared
//! [`Power`] state (live tree, power cut); the model itself is in the crate root.

#[allow(clippy::wildcard_imports)]
use super::*;

pub(crate) struct CrashFs(pub(crate) Power);

macro_rules! tri {
    ($reply:ident, $e:expr) => {
        match $e {
            Ok(v) => v,
            Err(e) => return $reply.error(e),
        }
    };
}

impl Filesystem for CrashFs {
    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let s = self.0.lock();
        tri!(reply, s.alive());
        let ino = tri!(reply, s.child(parent, name));
        let attr = tri!(reply, s.attr(ino));
        reply.entry(&TTL, &attr, Generation(0));
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        let s = self.0.lock();
        tri!(reply, s.alive());
        let attr = tri!(reply, s.attr(ino.0));
        reply.attr(&TTL, &attr);
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        _uid: Option<u32>,
        _gid: Option<u32>,
        size: Option<u64>,
        _atime: Option<TimeOrNow>,
        _mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let mut s = self.0.lock();
        tri!(reply, s.alive());
        if let Some(size) = size {
            tri!(reply, s.file_mut(ino));
            tri!(reply, s.mutate());
            let len = tri!(reply, usize::try_from(size).map_err(|_| Errno::EFBIG));
            tri!(reply, s.file_mut(ino)).resize(len, 0);
        }
        if let Some(mode) = mode {
            tri!(reply, s.inode_mut(ino)).perm = (mode & 0o7777) as u16;
        }
        let attr = tri!(reply, s.attr(ino.0));
        reply.attr(&TTL, &attr);
    }

    fn mkdir(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        _mode: u32,
        _umask: u32,
        reply: ReplyEntry,
    ) {
        let mut s = self.0.lock();
        tri!(reply, s.alive());
        let ino = tri!(reply, s.new_node(parent, name, Body::Dir(BTreeMap::new())));
        let attr = tri!(reply, s.attr(ino));
        reply.entry(&TTL, &attr, Generation(0));
    }

    fn create(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        _mode: u32,
        _umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        let mut s = self.0.lock();
        tri!(reply, s.alive());
        let ino = match s.child(parent, name) {
            Ok(_) if flags & libc::O_EXCL != 0 => return reply.error(Errno::EEXIST),
            Ok(ino) => {
                if flags & libc::O_TRUNC != 0 {
                    tri!(reply, s.mutate());
                    tri!(reply, s.file_mut(INodeNo(ino))).clear();
                }
                ino
            }
            Err(_) => tri!(reply, s.new_node(parent, name, Body::File(Vec::new()))),
        };
        s.next_fh += 1;
        let fh = FileHandle(s.next_fh);
        let attr = tri!(reply, s.attr(ino));
        reply.created(&TTL, &attr, Generation(0), fh, FopenFlags::empty());
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let mut s = self.0.lock();
        tri!(reply, s.alive());
        tri!(reply, s.inode(ino));
        if flags.0 & libc::O_TRUNC != 0 {
            tri!(reply, s.mutate());
            tri!(reply, s.file_mut(ino)).clear();
        }
        s.next_fh += 1;
        reply.opened(FileHandle(s.next_fh), FopenFlags::empty());
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<fuser::LockOwner>,
        reply: ReplyData,
    ) {
        let mut s = self.0.lock();
        tri!(reply, s.alive());
        let d = tri!(reply, s.file_mut(ino));
        let from = usize::try_from(offset).unwrap_or(usize::MAX).min(d.len());
        let to = from.saturating_add(size as usize).min(d.len());
        reply.data(&d[from..to]);
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<fuser::LockOwner>,
        reply: ReplyWrite,
    ) {
        let mut s = self.0.lock();
        tri!(reply, s.file_mut(ino));
        tri!(reply, s.mutate());
        let d = tri!(reply, s.file_mut(ino));
        let at = tri!(reply, usize::try_from(offset).map_err(|_| Errno::EFBIG));
        let end = tri!(reply, at.checked_add(data.len()).ok_or(Errno::EFBIG));
        if d.len() < end {
            d.resize(end, 0);
        }
        d[at..end].copy_from_slice(data);
        reply.written(data.len() as u32);
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: fuser::LockOwner,
        reply: ReplyEmpty,
    ) {
        reply.ok();
    }

    fn fsync(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        let mut s = self.0.lock();
        tri!(reply, s.inode(ino));
        tri!(reply, s.mutate());
        let i = tri!(reply, s.inode_mut(ino));
        i.durable = i.live.clone();
        reply.ok();
    }

    fn fsyncdir(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        datasync: bool,
        reply: ReplyEmpty,
    ) {
        self.fsync(req, ino, fh, datasync, reply);
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let s = self.0.lock();
        tri!(reply, s.alive());
        let Body::Dir(m) = &tri!(reply, s.inode(ino)).live else {
            return reply.error(Errno::ENOTDIR);
        };
        let mut all = vec![
            (ino.0, FileType::Directory, OsString::from(".")),
            (ino.0, FileType::Directory, OsString::from("..")),
        ];
        for (name, &child) in m {
            all.push((child, s.img.inodes[&child].live.kind(), name.clone()));
        }
        for (i, (child, kind, name)) in all.into_iter().enumerate().skip(offset as usize) {
            if reply.add(INodeNo(child), (i + 1) as u64, kind, &name) {
                break;
            }
        }
        reply.ok();
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let mut s = self.0.lock();
        tri!(reply, s.alive());
        let ino = tri!(reply, s.child(parent, name));
        if matches!(s.img.inodes[&ino].live, Body::Dir(_)) {
            return reply.error(Errno::EISDIR);
        }
        tri!(reply, s.mutate());
        tri!(reply, s.dir_mut(parent)).remove(name);
        reply.ok();
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let mut s = self.0.lock();
        tri!(reply, s.alive());
        let ino = tri!(reply, s.child(parent, name));
        match &s.img.inodes[&ino].live {
            Body::Dir(m) if m.is_empty() => {}
            Body::Dir(_) => return reply.error(Errno::ENOTEMPTY),
            Body::File(_) => return reply.error(Errno::ENOTDIR),
        }
        tri!(reply, s.mutate());
        tri!(reply, s.dir_mut(parent)).remove(name);
        reply.ok();
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        let mut s = self.0.lock();
        tri!(reply, s.alive());
        if flags.intersects(RenameFlags::RENAME_EXCHANGE | RenameFlags::RENAME_WHITEOUT) {
            return reply.error(Errno::EINVAL);
        }
        let ino = tri!(reply, s.child(parent, name));
        tri!(reply, s.dir_mut(newparent));
        if let Ok(old) = s.child(newparent, newname) {
            if old == ino {
                return reply.ok();
            }
            if flags.contains(RenameFlags::RENAME_NOREPLACE) {
                return reply.error(Errno::EEXIST);
            }
            match (&s.img.inodes[&ino].live, &s.img.inodes[&old].live) {
                (Body::Dir(_), Body::Dir(m)) if !m.is_empty() => {
                    return reply.error(Errno::ENOTEMPTY);
                }
                (Body::Dir(_), Body::File(_)) => return reply.error(Errno::ENOTDIR),
                (Body::File(_), Body::Dir(_)) => return reply.error(Errno::EISDIR),
                _ => {}
            }
        }
        if matches!(s.img.inodes[&ino].live, Body::Dir(_)) {
            // Never move a directory under itself.
            let mut up = newparent.0;
            let parents = parents(&s.img);
            loop {
                if up == ino {
                    return reply.error(Errno::EINVAL);
                }
                match parents.get(&up) {
                    Some(&p) if p != up => up = p,
                    _ => break,
                }
            }
        }
        tri!(reply, s.mutate());
        tri!(reply, s.dir_mut(parent)).remove(name);
        tri!(reply, s.dir_mut(newparent)).insert(newname.to_owned(), ino);
        reply.ok();
    }

    fn fallocate(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        let mut s = self.0.lock();
        tri!(reply, s.file_mut(ino));
        if mode & !libc::FALLOC_FL_KEEP_SIZE != 0 {
            return reply.error(Errno::EOPNOTSUPP);
        }
        tri!(reply, s.mutate());
        if mode & libc::FALLOC_FL_KEEP_SIZE == 0 {
            let end = tri!(reply, offset.checked_add(length).ok_or(Errno::EFBIG));
            let end = tri!(reply, usize::try_from(end).map_err(|_| Errno::EFBIG));
            let d = tri!(reply, s.file_mut(ino));
            if d.len() < end {
                d.resize(end, 0);
            }
        }
        reply.ok();
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let s = self.0.lock();
        tri!(reply, s.alive());
        // 64 GiB of 4 KiB blocks, all free: the data lives in this process's memory.
        reply.statfs(1 << 24, 1 << 24, 1 << 24, 1 << 20, 1 << 20, 4096, 255, 4096);
    }

    fn access(&self, _req: &Request, _ino: INodeNo, _mask: fuser::AccessFlags, reply: ReplyEmpty) {
        reply.ok();
    }
}
